#!/bin/sh
# `make test` runs this before pytest: tests/test_browser.py needs a `chromium` on PATH.
# Playwright's own browser download is not used (the course's machines reach only package
# registries), so where the machine allows it, install Debian's Chromium with apt-get: when
# `chromium` is missing, apt-get exists and this runs as root. Anywhere else do nothing; the
# browser test then skips with the reason (or fails, with CI=true). Never fails `make test`.
command -v chromium >/dev/null 2>&1 && exit 0
command -v apt-get >/dev/null 2>&1 || exit 0
[ "$(id -u)" = 0 ] || exit 0

echo "ensure_chromium: installing Debian's chromium with apt-get for tests/test_browser.py"
log=$(mktemp)
export DEBIAN_FRONTEND=noninteractive
# A fresh image has no package lists: update only if the first try cannot find the package.
if ! apt-get install -y -qq chromium >"$log" 2>&1; then
    apt-get update -qq >>"$log" 2>&1
    if ! apt-get install -y -qq chromium >>"$log" 2>&1; then
        echo "ensure_chromium: apt-get could not install chromium (the browser test will skip; with CI=true it fails):"
        tail -n 5 "$log"
    fi
fi
rm -f "$log"
exit 0
