from polygateway.testing.contracts import BreakerContract


class TestBreakerContract(BreakerContract):
    """Runs once per backend of the ``governance_backend`` fixture (conftest.py)."""
