#!/usr/bin/env python3
"""Placement vectors for test_client's test_place: which endpoint rendezvous hashing picks for
each key, computed with Python's hashlib.blake2b (a reference no one on this project wrote), as
snapkv.h defines the weight: the first 8 bytes, little-endian, of the 16-byte BLAKE2b of the
endpoint name, a NUL byte and the key. Prints C initialisers; standard library only.

usage: python3 tests/reference/gen_place_vectors.py"""
import hashlib

ENDPOINTS = ["ipc:///run/snapkvd/a.sock", "ipc:///run/snapkvd/b.sock", "tcp://10.0.0.3:5555",
             "tcp://10.0.0.4:5555", "tcp://[fd00::5]:5555"]


def weight(name, key):
    return int.from_bytes(hashlib.blake2b(name.encode() + b"\0" + key, digest_size=16).digest()[:8], "little")


def place(names, key):
    # the highest weight; equal weights: the lower name, bytewise (C's strcmp)
    return min(range(len(names)), key=lambda i: (-weight(names[i], key), names[i].encode()))


keys = [b"key-%d" % i for i in range(64)]
print("/* tests/reference/gen_place_vectors.py */")
print('static const char PLACE_ALL5[] = "%s";' % "".join(str(place(ENDPOINTS, k)) for k in keys))
print('static const char PLACE_FIRST3[] = "%s";' % "".join(str(place(ENDPOINTS[:3], k)) for k in keys))
print("static const size_t PLACE_EMPTY_KEY = %d; /* all five, a key of 0 bytes */" % place(ENDPOINTS, b""))
