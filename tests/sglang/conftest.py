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


def pytest_configure(config):
    """The in-process tests build managers outside an SGLang server: this process stands for
    one rank of attention TP 1 (what SGLang's scheduler publishes before it builds a backend).
    The two-process tests publish their own, through SGLang's ``publish``."""
    try:
        from sglang.srt.runtime_context import get_parallel
    except ImportError:
        return
    get_parallel().override_permanently(attn_tp_rank=0, attn_tp_size=1, attn_dp_rank=0, attn_dp_size=1,
                                        attn_cp_size=1, attn_cp_rank=0, pp_size=1, dp_size=1)
