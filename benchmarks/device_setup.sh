# Source this on the device machine (repo root): installs cbtrace and its missing deps into /tmp/site.
# The device image lacks these wheels; fetch them here first (py3.12) and carry .whl:
#   python3 -m pip download -q --dest .whl --only-binary=:all: --python-version 3.12 \
#     --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform any --no-deps \
#     msgspec rich markdown-it-py mdurl pygments perfetto isal
set -e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade --target /tmp/site . >/tmp/site_install.log 2>&1 || { cat /tmp/site_install.log; exit 1; }
export PYTHONPATH=/tmp/site
export PYTHONUNBUFFERED=1
cd /tmp && python3 -c "import cbtrace, cbtrace.replay, cbtrace.plugins.backends, msgspec, torch; print('cbtrace ok; torch', torch.__version__, torch.cuda.get_device_name())" && cd - >/dev/null
set +e
