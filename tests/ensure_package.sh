#!/bin/sh
# `make test` (and `make grade`) run this for a program the tests or the grader need:
#     sh tests/ensure_package.sh COMMAND PACKAGE "who needs it" ["said where it cannot install"]
# The course's machines reach only package registries, so where the machine allows it, install
# Debian's PACKAGE with apt-get: when COMMAND is missing, apt-get exists and this runs as root.
# Anywhere else do nothing but say the fourth argument, if given. Never fails: what needs
# COMMAND says why it cannot run (tests/test_browser.py skips, or fails with CI=true; the
# grader refuses without its sandbox, and the sandbox tests fail).
command -v "$1" >/dev/null 2>&1 && exit 0
if ! command -v apt-get >/dev/null 2>&1 || [ "$(id -u)" != 0 ]; then
    [ -n "$4" ] && echo "ensure_package: $4"
    exit 0
fi

echo "ensure_package: installing Debian's $2 with apt-get for $3"
log=$(mktemp)
export DEBIAN_FRONTEND=noninteractive
# A fresh image has no package lists: update only if the first try cannot find the package.
if ! apt-get install -y -qq "$2" >"$log" 2>&1; then
    apt-get update -qq >>"$log" 2>&1
    if ! apt-get install -y -qq "$2" >>"$log" 2>&1; then
        echo "ensure_package: apt-get could not install $2 ($3 will say why it cannot run):"
        tail -n 5 "$log"
    fi
fi
rm -f "$log"
exit 0
