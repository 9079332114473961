import pytest


@pytest.fixture
def anyio_backend():
    """Every async test runs on trio, the backend the actors use."""
    return "trio"
