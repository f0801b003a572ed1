"""Traces: marking, capturing and analysing what each stage does (see the modules)."""
