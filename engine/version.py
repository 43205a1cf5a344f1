"""The installed distribution's version, for `queryqueue.__version__` and `--version`."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def package_version() -> str:
    try:
        return version("queryqueue")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "0+unknown"
