# One image for migrate, worker, beat, Flower and admin (compose.yaml picks the command and
# PROJ_ROLE, which the HEALTHCHECK reads). Users build it on the official Python image; CI
# builds it on a local Debian base (`--build-arg BASE=local/bookworm`, scripts/docker-images).
ARG BASE=python:3.11-slim-bookworm

FROM ${BASE} AS deps
# Lets scripts/docker-images drop the build stages' untagged images after a rebuild, and only ours.
LABEL proj.stage=build
# Debian's python3 needs python3-venv; the official Python image has it already.
RUN python3 -c "import ensurepip, venv" 2>/dev/null \
 || (apt-get update && apt-get install -y --no-install-recommends python3-venv \
     && rm -rf /var/lib/apt/lists/*)
WORKDIR /src
# docker-ca.crt: only where builds reach PyPI through a TLS-inspecting proxy (scripts/docker-images
# copies the host's CA bundle); absent for users. It stays in this stage.
COPY pyproject.toml docker-ca.crt* ./
# The dependencies first, in a layer of their own: a code change finds it in the build cache and
# installs only proj (pip spent ~45 s on the dependencies at every change to proj/).
# scripts/docker-images tags this stage (proj/app-deps:ci), so its pruning keeps the layer.
RUN if [ -f docker-ca.crt ]; then export PIP_CERT=/src/docker-ca.crt; fi \
 && python3 -c "import tomllib; t = tomllib.load(open('pyproject.toml', 'rb')); \
print('\n'.join(t['build-system']['requires'] + t['project']['dependencies']))" > /tmp/deps.txt \
 && python3 -m venv /opt/proj \
 && /opt/proj/bin/pip install --no-cache-dir --disable-pip-version-check -r /tmp/deps.txt

FROM deps AS build
COPY README.md alembic.ini ./
COPY proj ./proj
COPY ledger ./ledger
COPY outbox ./outbox
COPY migrations ./migrations
# A real (non-editable) install into the venv, which the runtime stage copies as is.
RUN /opt/proj/bin/pip install --no-cache-dir --disable-pip-version-check --no-deps \
      --no-build-isolation . \
 && /opt/proj/bin/proj --help > /dev/null

FROM ${BASE}
# The venv's interpreter is the base's python3: present in the official image, installed on Debian.
RUN command -v python3 >/dev/null \
 || (apt-get update && apt-get install -y --no-install-recommends python3 \
     && rm -rf /var/lib/apt/lists/*)
RUN useradd --system --uid 10001 --create-home --home-dir /home/proj proj \
 && mkdir -p /library /downloads \
 && chown proj /library /downloads
COPY --from=build /opt/proj /opt/proj
ENV PATH=/opt/proj/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    LIBRARY_ROOT=/library \
    DOWNLOAD_DIR=/downloads \
    PROJ_ROLE=worker
USER proj
WORKDIR /home/proj
HEALTHCHECK --interval=10s --timeout=15s --start-period=40s --retries=5 CMD ["proj-healthcheck"]
CMD ["celery", "-A", "proj", "worker", "--loglevel", "INFO"]
