$d0 << EOD
1024 1.0000
2048 1.0000
4096 1.0000
EOD
$d1 << EOD
1024 0.9000
2048 0.8000
4096 0.9000
EOD
$d2 << EOD
1024 0.2000
2048 0.2000
4096 0.2000
EOD
if (strstrt(GPVAL_TERMINALS, 'pngcairo') > 0) {
    set terminal pngcairo size 760,460 font ',9'
} else {
    set terminal png size 760,460
}
set termoption noenhanced
set output 'passkey_accuracy.png'
set title 'Passkey retrieval: SmolLM2-135M-Instruct.Q4_1.gguf'
set logscale x 2
set xtics ('1024' 1024, '2048' 2048, '4096' 4096)
set xlabel 'prompt length (tokens)'
set ylabel 'accuracy'
set yrange [-0.05:1.05]
set grid
set key below maxrows 4
plot $d0 using ($1*(1+0.015*(0-3/2.0))):2 with linespoints lw 3 title 'full cache (baseline)', \
     $d1 using ($1*(1+0.015*(1-3/2.0))):2 with linespoints lw 1 title 'policy=snapkv,ratio=0.1', \
     $d2 using ($1*(1+0.015*(2-3/2.0))):2 with linespoints lw 1 title 'policy=streaming,ratio=0.1'
