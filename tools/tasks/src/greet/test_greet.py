from greet import greet


# Exact type first: a str subclass whose __eq__ is always true would pass a bare `==`.
def test_greet() -> None:
    result = greet("Ada")
    assert type(result) is str and result == "Hello, Ada!"
