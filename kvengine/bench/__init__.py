"""``kvengine bench``: benchmarks a user can run on an installed kvengine.

Each prints its figures beside baselines measured in the same run and writes
JSON and a PNG (matplotlib, ``pip install kvengine[bench]``).
"""
