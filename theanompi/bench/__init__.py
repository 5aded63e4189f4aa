"""Benchmarks: each module has ``main(argv) -> int`` printing a table of medians."""

__all__: list[str] = []
