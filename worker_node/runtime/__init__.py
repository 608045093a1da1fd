"""What every part of the worker stands on: the rank's process groups (`parallel.py`), host-to-device copies that
do not wait (`host_copy.py`) and huge-page memory (`huge_pages.py`)."""
