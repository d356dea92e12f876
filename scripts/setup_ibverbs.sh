#!/usr/bin/env bash
# The Mooncake wheel (the replay's `mooncake` system) loads libibverbs.so.1 at import without
# declaring it. Install Debian's libibverbs1 where it is missing and we are root; otherwise say
# that the replay will skip the `mooncake` system. Never fails the set-up.
set -u
if /sbin/ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 '; then
    exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "installing Debian's libibverbs1 (needed by the Mooncake wheel)"
    apt-get install -y -q libibverbs1 >/dev/null 2>&1 || \
        { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libibverbs1 >/dev/null 2>&1; } || \
        echo "warning: apt-get could not install libibverbs1: the replay will skip the mooncake system"
else
    echo "note: libibverbs1 is missing and cannot be installed here (needs root and apt-get):" \
         "the replay will skip the mooncake system"
fi
exit 0
