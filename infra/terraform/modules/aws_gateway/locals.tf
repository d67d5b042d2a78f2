locals {
  name = "${var.name_prefix}-gateway"
  # The gateway process inside its container; docker/gateway.Dockerfile sets the same defaults.
  container_port = 8000
  container_uid  = 10001
  # Where the gateway and one-off retraining tasks share predictor artifacts (EFS).
  predictor_mount = "/srv/fedllm/predictor"
  database_name   = "fedllm"
  database_user   = "fedllm"
  # The password reaches the container as PGPASSWORD (read by libpq), never inside the URL.
  # sslmode=require: the connection stays inside the VPC and is encrypted; RDS enforces TLS.
  database_url = "postgresql+psycopg://${local.database_user}@${aws_db_instance.gateway.address}:${aws_db_instance.gateway.port}/${local.database_name}?sslmode=require"
  environment = merge(var.environment, {
    GATEWAY_DATABASE_URL = local.database_url
    GATEWAY_HOST         = "0.0.0.0"
    GATEWAY_PORT         = tostring(local.container_port)
    # A public endpoint: every client request carries a live API key (docs/security.md).
    GATEWAY_REQUIRE_API_KEYS = "true"
  })
  # Litestar strips a trailing slash when it routes, so "/metrics/" is the metrics page too.
  admin_paths = ["/admin", "/admin/*", "/metrics", "/metrics/*"]
}
