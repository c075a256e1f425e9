"""Storage microbenchmarks behind ``kvpool bench`` (installed as ``kvpool.bench``).

Every benchmark measures its baseline in the same run and reports the ratio.
"""
