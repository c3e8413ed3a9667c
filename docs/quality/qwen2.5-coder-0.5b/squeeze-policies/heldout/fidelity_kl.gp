$s0 << EOD
0.1001 0.272356 0.8984 0.1797
0.2001 0.217293 0.9219 0.3516
EOD
$s1 << EOD
0.1001 0.289072 0.8984 0.0547
0.2001 0.23543 0.9141 0.3516
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
