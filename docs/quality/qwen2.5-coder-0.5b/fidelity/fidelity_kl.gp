$s0 << EOD
0.1002 0.242374 0.8542 0.1979
0.2004 0.0892435 0.8958 0.2396
0.5000 0.0201291 0.9323 0.2708
EOD
$s1 << EOD
0.1002 0.288547 0.8177 0.1458
0.2004 0.149083 0.8594 0.2448
0.5000 0.0251517 0.9219 0.2656
EOD
$s2 << EOD
0.1027 0.2885 0.8229 0.0781
0.2063 0.146267 0.9010 0.2188
EOD
$s3 << EOD
0.1002 0.259681 0.8542 0.2188
0.2004 0.186967 0.8750 0.2500
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
plot $s0 using 1:2 with linespoints title 'policy=snapkv', $s1 using 1:2 with linespoints title 'policy=snapkv,alloc=squeeze', $s2 using 1:2 with linespoints title 'policy=snapkv,alloc=pyramid', $s3 using 1:2 with linespoints title 'policy=streaming'
unset logscale y
set key bottom right
set yrange [0:1.02]
set ylabel 'top-1 agreement'
plot $s0 using 1:3 with linespoints title 'policy=snapkv', $s1 using 1:3 with linespoints title 'policy=snapkv,alloc=squeeze', $s2 using 1:3 with linespoints title 'policy=snapkv,alloc=pyramid', $s3 using 1:3 with linespoints title 'policy=streaming'
unset multiplot
