#!/bin/sh
# Runs test_proto_python.py (a client written from proto/snapkv.proto alone, in Python) with a
# python3 that has Debian's python3-protobuf and python3-zmq: /usr/bin/python3 first, since a
# pyenv's or a venv's python3 ahead on PATH may lack them. 77 (skipped) when none has them.
here=$(dirname "$0")
for py in /usr/bin/python3 python3; do
    if "$py" -c "import google.protobuf, zmq" 2>/dev/null; then
        exec "$py" "$here/test_proto_python.py"
    fi
done
echo "SKIP: no python3 with google.protobuf and zmq (Debian: python3-protobuf, python3-zmq; scripts/setup)"
exit 77
