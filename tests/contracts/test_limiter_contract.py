from polygateway.testing.contracts import LimiterContract


class TestLimiterContract(LimiterContract):
    """Runs once per backend of the ``governance_backend`` fixture (conftest.py)."""
