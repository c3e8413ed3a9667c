$s0 << EOD
0.1003 0.469201 0.7292 0.1042 0.1
0.2004 0.2917 0.7969 0.1562 0.2
0.5001 0.0147414 0.9531 0.2708 0.5
EOD
$s1 << EOD
0.1003 0.639878 0.6823 0.0781 0.1
0.2004 0.421874 0.7552 0.1510 0.2
0.5001 0.0169606 0.9531 0.2812 0.5
EOD
if (strstrt(GPVAL_TERMINALS, 'pngcairo') > 0) {
    set terminal pngcairo size 960,400 font ',9'
} else {
    set terminal png size 960,400
}
set termoption noenhanced
set output 'fidelity_kl.png'
set multiplot layout 1,2 title 'Fidelity vs the full cache: SmolLM2-135M-Instruct.Q4_1.gguf'
set grid
set xlabel 'KV kept after prefill (fraction of the full cache)'
set key bottom left
set logscale y
set ylabel 'mean KL(full || compressed), nats'
plot $s0 using 1:2 with linespoints title 'policy=snapkv', $s1 using 1:2 with linespoints title 'policy=snapkv,alloc=squeeze'
unset logscale y
set key bottom right
set yrange [0:1.02]
set ylabel 'top-1 agreement'
plot $s0 using 1:3 with linespoints title 'policy=snapkv', $s1 using 1:3 with linespoints title 'policy=snapkv,alloc=squeeze'
unset multiplot
