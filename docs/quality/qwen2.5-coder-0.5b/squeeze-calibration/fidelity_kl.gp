$s0 << EOD
0.1001 0.264298 0.8750 0.0547
0.2001 0.110085 0.9375 0.0469
EOD
$s1 << EOD
0.1001 0.345939 0.8672 0.0703
0.2001 0.147266 0.9297 0.0391
EOD
$s2 << EOD
0.1001 0.345939 0.8672 0.0703
0.2001 0.147266 0.9297 0.0391
EOD
$s3 << EOD
0.1001 0.345939 0.8672 0.0703
0.2001 0.147266 0.9297 0.0391
EOD
$s4 << EOD
0.1001 0.339415 0.8672 0.0469
0.2001 0.146394 0.9297 0.0391
EOD
$s5 << EOD
0.1001 0.30639 0.8750 0.0547
0.2001 0.115556 0.9375 0.0469
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
plot $s0 using 1:2 with linespoints title 'policy=snapkv', $s1 using 1:2 with linespoints title 'policy=snapkv,alloc=squeeze,p=0.1', $s2 using 1:2 with linespoints title 'policy=snapkv,alloc=squeeze,p=0.3', $s3 using 1:2 with linespoints title 'policy=snapkv,alloc=squeeze,p=0.5', $s4 using 1:2 with linespoints title 'policy=snapkv,alloc=squeeze,p=0.7', $s5 using 1:2 with linespoints title 'policy=snapkv,alloc=squeeze,p=0.9'
unset logscale y
set key bottom right
set yrange [0:1.02]
set ylabel 'top-1 agreement'
plot $s0 using 1:3 with linespoints title 'policy=snapkv', $s1 using 1:3 with linespoints title 'policy=snapkv,alloc=squeeze,p=0.1', $s2 using 1:3 with linespoints title 'policy=snapkv,alloc=squeeze,p=0.3', $s3 using 1:3 with linespoints title 'policy=snapkv,alloc=squeeze,p=0.5', $s4 using 1:3 with linespoints title 'policy=snapkv,alloc=squeeze,p=0.7', $s5 using 1:3 with linespoints title 'policy=snapkv,alloc=squeeze,p=0.9'
unset multiplot
