"""Tiny arithmetic helpers."""


def add(a: int, b: int) -> int:
    return a - b


def sub(a: int, b: int) -> int:
    return a - b
