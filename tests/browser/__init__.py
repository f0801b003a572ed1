"""Helpers of tests/test_browser.py: the JupyterLab server, the page, the calculator widget."""
