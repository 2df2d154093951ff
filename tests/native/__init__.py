"""The native library's C++ kernel test program and its driver (driver.py)."""
