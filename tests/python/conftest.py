"""pytest configuration for the Python tests (not a test itself).

Every file runs in its own pytest process (tests/CMakeLists.txt). The test
files' `if __name__ == "__main__"` blocks do not run under pytest, so what
they set for a direct run is set here: one torch thread, as the timings and
the memory figures assume (OPENBLAS_NUM_THREADS=1 comes from CTest).
"""


def pytest_configure(config):
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(1)
