$s0l0 << EOD
0.1 0.0000
0.151 0.5000
0.2 0.5000
0.3 0.8000
EOD
$s0l1 << EOD
0.1002 1.0000
0.1503 1.0000
0.2004 1.0000
0.3006 1.0000
EOD
$s0l2 << EOD
0.1002 0.7000
0.15 0.8000
0.2004 0.9000
0.3001 1.0000
EOD
$s1l0 << EOD
0.1 0.0000
0.151 0.4000
0.2 0.6000
EOD
$s1l1 << EOD
0.1002 1.0000
0.1503 1.0000
0.2004 1.0000
EOD
$s1l2 << EOD
0.1002 0.8000
0.15 0.8000
0.2004 1.0000
EOD
$s2l0 << EOD
0.1 0.0000
0.2 1.0000
0.3 1.0000
EOD
$s2l1 << EOD
0.1002 1.0000
0.2004 1.0000
0.3006 1.0000
EOD
$s2l2 << EOD
0.1002 1.0000
0.2004 1.0000
0.3001 1.0000
EOD
$s3l0 << EOD
0.1 0.2000
0.2 0.2000
0.3 0.4000
EOD
$s3l1 << EOD
0.1002 0.2000
0.2004 0.2000
0.3006 0.4000
EOD
$s3l2 << EOD
0.1002 0.2000
0.2004 0.2000
0.3001 0.4000
EOD
if (strstrt(GPVAL_TERMINALS, 'pngcairo') > 0) {
    set terminal pngcairo size 1030,474 font ',9'
} else {
    set terminal png size 1030,474
}
set termoption noenhanced
set output 'passkey_budget.png'
set multiplot layout 1,3 title 'Passkey accuracy vs budget: SmolLM2-135M-Instruct.Q4_1.gguf (dashed: full cache)' margins 0.058,0.98,0.262,0.873 spacing 0.068,0.200
set grid
set xlabel 'KV kept (fraction of the full cache)'
set ylabel 'accuracy'
set xrange [0:0.34]
set yrange [-0.05:1.05]
set key at screen 0.5,0.01 center bottom vertical maxrows 4
set title '512 tokens'
plot 1.0000 with lines dashtype 2 lc rgb 'black' notitle, \
     $s0l0 using 1:2 with linespoints title 'policy=snapkv', \
     $s1l0 using 1:2 with linespoints title 'policy=snapkv,granularity=head', \
     $s2l0 using 1:2 with linespoints title 'policy=snapkv,kernel=11', \
     $s3l0 using 1:2 with linespoints title 'policy=streaming'
set title '1024 tokens'
unset key
plot 1.0000 with lines dashtype 2 lc rgb 'black' notitle, \
     $s0l1 using 1:2 with linespoints title 'policy=snapkv', \
     $s1l1 using 1:2 with linespoints title 'policy=snapkv,granularity=head', \
     $s2l1 using 1:2 with linespoints title 'policy=snapkv,kernel=11', \
     $s3l1 using 1:2 with linespoints title 'policy=streaming'
set title '2048 tokens'
plot 1.0000 with lines dashtype 2 lc rgb 'black' notitle, \
     $s0l2 using 1:2 with linespoints title 'policy=snapkv', \
     $s1l2 using 1:2 with linespoints title 'policy=snapkv,granularity=head', \
     $s2l2 using 1:2 with linespoints title 'policy=snapkv,kernel=11', \
     $s3l2 using 1:2 with linespoints title 'policy=streaming'
unset multiplot
