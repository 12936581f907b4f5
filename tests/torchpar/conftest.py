from tests.torchpar.runs import base, reference  # noqa: F401 - the shared fixtures
