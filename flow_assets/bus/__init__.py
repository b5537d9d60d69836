"""The RabbitMQ message-bus source (``flowopt bus``): tasks, responses and rewards joined into log batches."""
