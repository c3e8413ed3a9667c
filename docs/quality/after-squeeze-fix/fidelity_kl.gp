$s0 << EOD
0.1003 0.902468 0.6042 0.0573 0.1
0.2004 0.403379 0.7500 0.0938 0.2
0.5001 0.341284 0.7500 0.0573 0.5
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
plot $s0 using 1:2 with linespoints title 'policy=snapkv,alloc=squeeze'
unset logscale y
set key bottom right
set yrange [0:1.02]
set ylabel 'top-1 agreement'
plot $s0 using 1:3 with linespoints title 'policy=snapkv,alloc=squeeze'
unset multiplot
