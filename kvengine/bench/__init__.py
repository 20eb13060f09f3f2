"""``kvengine bench``: benchmarks a user can run on an installed kvengine.

    kvengine bench throughput --transport shm|tcp   push GB/s, one layer .. 256 MiB cache
    kvengine bench latency --transport shm|tcp      one-layer push p50/p99/p99.9
    kvengine bench load                             EDF vs FIFO under mixed load (tcp)

Each prints its figures beside baselines measured in the same run (and, for
throughput and latency, beside NIXL and Mooncake when installed: see
``pip install kvengine[peers]`` or ``benchmarks/install_peers.sh``) and writes JSON and a PNG (matplotlib,
``pip install kvengine[bench]``, which also brings uvloop and tqdm).
"""
