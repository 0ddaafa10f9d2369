#!/usr/bin/env bash
# Browser tests drive Debian's Chromium (/usr/bin/chromium). Install it when we can (root + apt).
command -v chromium >/dev/null 2>&1 && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
    && exit 0
fi
echo "chromium not installed: browser tests will be skipped" >&2
