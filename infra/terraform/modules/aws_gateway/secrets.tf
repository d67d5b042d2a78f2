# Two secrets in Secrets Manager, both under the deployment's KMS key: the gateway's bundle (its
# mTLS client certificate, the federation CA, an admin token, the Hugging Face token) and the
# database credentials. ECS injects single JSON keys of them as environment variables.

resource "random_password" "admin_token" {
  length  = 48
  special = false
}

resource "aws_secretsmanager_secret" "gateway" {
  #checkov:skip=CKV2_AWS_57:The bundle holds TLS material Terraform re-issues before expiry (early_renewal_hours), a token that only changes with a replaced task, and an externally issued Hugging Face token; a rotation Lambda could renew none of them.
  region                  = var.region
  name                    = "${var.name_prefix}/gateway/bundle"
  description             = "fedllm gateway: mTLS client certificate and key, federation CA, admin token, Hugging Face token"
  kms_key_id              = var.kms_key_arn
  recovery_window_in_days = 7
  tags                    = var.tags
}

resource "aws_secretsmanager_secret_version" "gateway" {
  region    = var.region
  secret_id = aws_secretsmanager_secret.gateway.id
  secret_string = jsonencode(merge(
    {
      ca_pem      = var.tls.ca_cert_pem
      cert_pem    = var.tls.cert_pem
      key_pem     = var.tls.private_key_pem
      admin_token = random_password.admin_token.result
    },
    var.hf_token == null ? {} : { hf_token = var.hf_token },
  ))
}

resource "aws_secretsmanager_secret" "database" {
  #checkov:skip=CKV2_AWS_57:Gateways read the password once at start-up; rotating it behind their back would cut them off. Rotate with `terraform apply -replace=module.gateway.random_password.database`, which also rolls the tasks.
  region                  = var.region
  name                    = "${var.name_prefix}/gateway/database"
  description             = "fedllm gateway: PostgreSQL credentials"
  kms_key_id              = var.kms_key_arn
  recovery_window_in_days = 7
  tags                    = var.tags
}

resource "aws_secretsmanager_secret_version" "database" {
  region    = var.region
  secret_id = aws_secretsmanager_secret.database.id
  secret_string = jsonencode({
    username = local.database_user
    password = random_password.database.result
  })
}
