import pytest


@pytest.fixture(autouse=True)
def forget_prepared_models():
    """Each test starts and ends with no prepared model and Trainer / deepspeed unpatched."""
    yield
    from stronghold.integrations import hf
    for model in list(hf._REGISTRY.keys()):
        hf.unprepare(model)
    hf._uninstall()
