# One image for worker, beat, flower and admin (compose.yaml picks the command).
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md alembic.ini ./
COPY proj ./proj
COPY ledger ./ledger
COPY outbox ./outbox
COPY migrations ./migrations
RUN pip install --no-cache-dir -e .
ENV PYTHONUNBUFFERED=1
CMD ["celery", "-A", "proj", "worker", "--loglevel", "INFO"]
