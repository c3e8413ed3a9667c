$d0 << EOD
512 1.0000
1024 1.0000
2048 1.0000
4096 1.0000
EOD
$d1 << EOD
512 0.0000
1024 0.8000
2048 1.0000
4096 1.0000
EOD
$d2 << EOD
512 0.2000
1024 0.2000
2048 0.2000
4096 0.2000
EOD
$d3 << EOD
512 0.3000
1024 0.6000
2048 1.0000
4096 1.0000
EOD
$d4 << EOD
512 0.0000
1024 1.0000
2048 1.0000
4096 1.0000
EOD
$d5 << EOD
512 1.0000
1024 1.0000
2048 1.0000
4096 1.0000
EOD
if (strstrt(GPVAL_TERMINALS, 'pngcairo') > 0) {
    set terminal pngcairo size 760,460 font ',9'
} else {
    set terminal png size 760,460
}
set termoption noenhanced
set output 'passkey_accuracy.png'
set title 'Passkey retrieval: Qwen2.5-Coder-0.5B-Instruct-AWQ.Q4_K_M.gguf'
set logscale x 2
set xtics ('512' 512, '1024' 1024, '2048' 2048, '4096' 4096)
set xlabel 'prompt length (tokens)'
set ylabel 'accuracy'
set yrange [-0.05:1.05]
set grid
set key below maxrows 4
plot $d0 using ($1*(1+0.015*(0-6/2.0))):2 with linespoints lw 3 title 'full cache (baseline)', \
     $d1 using ($1*(1+0.015*(1-6/2.0))):2 with linespoints lw 1 title 'policy=snapkv,ratio=0.1', \
     $d2 using ($1*(1+0.015*(2-6/2.0))):2 with linespoints lw 1 title 'policy=streaming,ratio=0.1', \
     $d3 using ($1*(1+0.015*(3-6/2.0))):2 with linespoints lw 1 title 'policy=snapkv,ratio=0.1,alloc=squeeze', \
     $d4 using ($1*(1+0.015*(4-6/2.0))):2 with linespoints lw 1 title 'policy=snapkv,ratio=0.1,kernel=11', \
     $d5 using ($1*(1+0.015*(5-6/2.0))):2 with linespoints lw 1 title 'policy=snapkv,ratio=0.1,min_budget=128,kernel=11'
