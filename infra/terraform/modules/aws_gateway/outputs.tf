output "public_endpoint" {
  description = "Base URL of the OpenAI-compatible API."
  value       = "https://${var.domain_name}"
}

output "admin_url" {
  description = "URL of the admin surface (reachable from var.admin_cidrs only)."
  value       = "https://${var.domain_name}/admin"
}

output "load_balancer_dns_name" {
  description = "DNS name of the load balancer, for a CNAME when DNS is not in Route 53."
  value       = aws_lb.gateway.dns_name
}

output "database_address" {
  description = "Host name of the PostgreSQL instance (private)."
  value       = aws_db_instance.gateway.address
}

output "secret_arns" {
  description = "Secrets Manager ARNs: the gateway bundle (includes admin_token) and the database credentials."
  value = {
    gateway  = aws_secretsmanager_secret.gateway.arn
    database = aws_secretsmanager_secret.database.arn
  }
}

output "predictor_mount" {
  description = "Path of the shared predictor file system inside gateway containers."
  value       = local.predictor_mount
}

output "retrain_command" {
  description = "Runs gateway.retrain_predictor as a one-off task of the trainer image; replace VERSION with a new directory name."
  value = join(" ", [
    "aws ecs run-task --region ${var.region} --cluster ${aws_ecs_cluster.gateway.name}",
    "--launch-type FARGATE --task-definition ${aws_ecs_task_definition.retrain.family}",
    "--network-configuration 'awsvpcConfiguration={subnets=[${join(",", var.private_subnet_ids)}],securityGroups=[${aws_security_group.tasks.id}],assignPublicIp=DISABLED}'",
    "--overrides '${jsonencode({ containerOverrides = [{ name = local.retrain_container.name, command = local.retrain_command }] })}'",
  ])
}
