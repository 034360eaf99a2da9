FROM python:3.11-slim
ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
WORKDIR /app
COPY requirements.txt .
RUN pip install --no-cache-dir -r requirements.txt
COPY manage.py ./
COPY project ./project
COPY dispatcher ./dispatcher
# The admin's and the dashboard's static files, hashed and compressed into the image; WhiteNoise
# serves them from there (outside var/, which a volume may cover). No database is touched.
ENV DJANGO_STATIC_ROOT=/app/static
RUN CELERY_BROKER_URL=memory:// python manage.py collectstatic --noinput
RUN useradd --create-home app && mkdir -p /app/var && chown app /app/var
USER app
EXPOSE 8000
CMD ["gunicorn", "project.wsgi:application", "--bind", "0.0.0.0:8000", "--workers", "3"]
