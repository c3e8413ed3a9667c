$s0 << EOD
0.1002 0.369981 0.7578 0.2109 0.1
0.2003 0.15646 0.8906 0.2422 0.2
EOD
$s1 << EOD
0.1002 0.488976 0.7500 0.1484 0.1
0.2003 0.27156 0.7734 0.1094 0.2
EOD
$s2 << EOD
0.1002 0.488976 0.7500 0.1484 0.1
0.2003 0.27156 0.7734 0.1094 0.2
EOD
$s3 << EOD
0.1002 0.488976 0.7500 0.1484 0.1
0.2003 0.271098 0.7812 0.1094 0.2
EOD
$s4 << EOD
0.1002 0.459734 0.7734 0.0859 0.1
0.2003 0.243958 0.8281 0.2422 0.2
EOD
$s5 << EOD
0.1002 0.412061 0.7500 0.2188 0.1
0.2003 0.176998 0.8516 0.2109 0.2
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
plot $s0 using 1:2 with linespoints title 'policy=snapkv', $s1 using 1:2 with linespoints title 'policy=snapkv,alloc=squeeze,p=0.1', $s2 using 1:2 with linespoints title 'policy=snapkv,alloc=squeeze,p=0.3', $s3 using 1:2 with linespoints title 'policy=snapkv,alloc=squeeze,p=0.5', $s4 using 1:2 with linespoints title 'policy=snapkv,alloc=squeeze,p=0.7', $s5 using 1:2 with linespoints title 'policy=snapkv,alloc=squeeze,p=0.9'
unset logscale y
set key bottom right
set yrange [0:1.02]
set ylabel 'top-1 agreement'
plot $s0 using 1:3 with linespoints title 'policy=snapkv', $s1 using 1:3 with linespoints title 'policy=snapkv,alloc=squeeze,p=0.1', $s2 using 1:3 with linespoints title 'policy=snapkv,alloc=squeeze,p=0.3', $s3 using 1:3 with linespoints title 'policy=snapkv,alloc=squeeze,p=0.5', $s4 using 1:3 with linespoints title 'policy=snapkv,alloc=squeeze,p=0.7', $s5 using 1:3 with linespoints title 'policy=snapkv,alloc=squeeze,p=0.9'
unset multiplot
