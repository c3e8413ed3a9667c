$s0l0 << EOD
0.1018 0.0000
0.1507 0.3500
0.2016 0.8000
0.3014 1.0000
EOD
$s0l1 << EOD
0.1005 0.9000
0.1507 1.0000
0.2 1.0000
0.3005 1.0000
EOD
if (strstrt(GPVAL_TERMINALS, 'pngcairo') > 0) {
    set terminal pngcairo size 700,426 font ',9'
} else {
    set terminal png size 700,426
}
set termoption noenhanced
set output 'passkey_budget.png'
set multiplot layout 1,2 title 'Passkey accuracy vs budget: Qwen2.5-Coder-0.5B-Instruct-AWQ.Q4_K_M.gguf (dashed: full cache)' margins 0.086,0.98,0.178,0.859 spacing 0.100,0.223
set grid
set xlabel 'KV kept (fraction of the full cache)'
set ylabel 'accuracy'
set xrange [0:0.341]
set yrange [-0.05:1.05]
set key at screen 0.5,0.01 center bottom vertical maxrows 1
set title '512 tokens'
plot 1.0000 with lines dashtype 2 lc rgb 'black' notitle, \
     $s0l0 using 1:2 with linespoints title 'policy=snapkv'
set title '1024 tokens'
unset key
plot 1.0000 with lines dashtype 2 lc rgb 'black' notitle, \
     $s0l1 using 1:2 with linespoints title 'policy=snapkv'
unset multiplot
