$s0 << EOD
0.1002 0.259681 0.8542 0.2188
0.2004 0.186967 0.8750 0.2500
EOD
$s1 << EOD
0.1002 0.278121 0.8385 0.1823
0.2004 0.215492 0.8542 0.2604
EOD
if (strstrt(GPVAL_TERMINALS, 'pngcairo') > 0) {
    set terminal pngcairo size 960,400 font ',9'
} else {
    set terminal png size 960,400
}
set termoption noenhanced
set output 'fidelity_kl.png'
set multiplot layout 1,2 title 'Fidelity vs the full cache: Qwen2.5-Coder-0.5B-Instruct-AWQ.Q4_K_M.gguf'
set grid
set xlabel 'KV kept after prefill (fraction of the full cache)'
set key bottom left
set logscale y
set ylabel 'mean KL(full || compressed), nats'
plot $s0 using 1:2 with linespoints title 'policy=streaming', $s1 using 1:2 with linespoints title 'policy=streaming,alloc=squeeze'
unset logscale y
set key bottom right
set yrange [0:1.02]
set ylabel 'top-1 agreement'
plot $s0 using 1:3 with linespoints title 'policy=streaming', $s1 using 1:3 with linespoints title 'policy=streaming,alloc=squeeze'
unset multiplot
