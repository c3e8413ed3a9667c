$d0 << EOD
512 1.0000
1024 1.0000
2048 1.0000
EOD
$d1 << EOD
512 0.0000
1024 1.0000
2048 0.7000
EOD
$d2 << EOD
512 0.5000
1024 1.0000
2048 0.8000
EOD
$d3 << EOD
512 0.5000
1024 1.0000
2048 0.9000
EOD
$d4 << EOD
512 0.8000
1024 1.0000
2048 1.0000
EOD
$d5 << EOD
512 0.0000
1024 1.0000
2048 0.8000
EOD
$d6 << EOD
512 0.4000
1024 1.0000
2048 0.8000
EOD
$d7 << EOD
512 0.6000
1024 1.0000
2048 1.0000
EOD
$d8 << EOD
512 0.0000
1024 1.0000
2048 1.0000
EOD
$d9 << EOD
512 1.0000
1024 1.0000
2048 1.0000
EOD
$d10 << EOD
512 1.0000
1024 1.0000
2048 1.0000
EOD
$d11 << EOD
512 0.2000
1024 0.2000
2048 0.2000
EOD
$d12 << EOD
512 0.2000
1024 0.2000
2048 0.2000
EOD
$d13 << EOD
512 0.4000
1024 0.4000
2048 0.4000
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
set xtics ('512' 512, '1024' 1024, '2048' 2048)
set xlabel 'prompt length (tokens)'
set ylabel 'accuracy'
set yrange [-0.05:1.05]
set grid
set key below maxrows 4
plot $d0 using ($1*(1+0.015*(0-14/2.0))):2 with linespoints lw 3 title 'full cache (baseline)', \
     $d1 using ($1*(1+0.015*(1-14/2.0))):2 with linespoints lw 1 title 'policy=snapkv,ratio=0.1', \
     $d2 using ($1*(1+0.015*(2-14/2.0))):2 with linespoints lw 1 title 'policy=snapkv,ratio=0.15', \
     $d3 using ($1*(1+0.015*(3-14/2.0))):2 with linespoints lw 1 title 'policy=snapkv,ratio=0.2', \
     $d4 using ($1*(1+0.015*(4-14/2.0))):2 with linespoints lw 1 title 'policy=snapkv,ratio=0.3', \
     $d5 using ($1*(1+0.015*(5-14/2.0))):2 with linespoints lw 1 title 'policy=snapkv,ratio=0.1,granularity=head', \
     $d6 using ($1*(1+0.015*(6-14/2.0))):2 with linespoints lw 1 title 'policy=snapkv,ratio=0.15,granularity=head', \
     $d7 using ($1*(1+0.015*(7-14/2.0))):2 with linespoints lw 1 title 'policy=snapkv,ratio=0.2,granularity=head', \
     $d8 using ($1*(1+0.015*(8-14/2.0))):2 with linespoints lw 1 title 'policy=snapkv,ratio=0.1,kernel=11', \
     $d9 using ($1*(1+0.015*(9-14/2.0))):2 with linespoints lw 1 title 'policy=snapkv,ratio=0.2,kernel=11', \
     $d10 using ($1*(1+0.015*(10-14/2.0))):2 with linespoints lw 1 title 'policy=snapkv,ratio=0.3,kernel=11', \
     $d11 using ($1*(1+0.015*(11-14/2.0))):2 with linespoints lw 1 title 'policy=streaming,ratio=0.1', \
     $d12 using ($1*(1+0.015*(12-14/2.0))):2 with linespoints lw 1 title 'policy=streaming,ratio=0.2', \
     $d13 using ($1*(1+0.015*(13-14/2.0))):2 with linespoints lw 1 title 'policy=streaming,ratio=0.3'
