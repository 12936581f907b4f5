from tests.torchpar.runs import base, changed_reference, reference  # noqa: F401 - the shared fixtures
