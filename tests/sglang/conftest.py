"""Says, in the test output, which SGLang the backend is tested against and how it was
installed (tools/test.sh)."""

from importlib.metadata import PackageNotFoundError, version


def pytest_report_header(config):
    try:
        sgl = version("sglang")
    except PackageNotFoundError:
        sgl = "not installed"
    try:
        torch = version("torch")
    except PackageNotFoundError:
        torch = "not installed"
    return [
        f"SGLang {sgl} from PyPI, installed without its dependencies (--no-deps) beside vLLM's "
        f"torch {torch}; SGLang's own code (queues, KV pool, plugin loader) runs unmodified on CPU"
    ]
