from calc import add, sub


# Exact types first: an object whose __eq__ is always true would pass a bare `==`.
def test_add() -> None:
    result = add(2, 3)
    assert type(result) is int and result == 5


def test_sub() -> None:
    result = sub(5, 3)
    assert type(result) is int and result == 2
