"""The media acquisition domain: requests, approvals, downloads, the library (schema `acq`).

Business code here never imports Celery; it talks to the engine through the `TaskEngine` port
and to the broker only through the transactional outbox.
"""
