"""`python -m benchmarks`: the whole suite (see benchmarks/suite.py)."""

from benchmarks.suite import main

if __name__ == "__main__":
    raise SystemExit(main())
