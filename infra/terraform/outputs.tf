output "public_endpoint" {
  description = "Base URL of the OpenAI-compatible API (POST /v1/completions, /v1/chat/completions; GET /v1/models, /healthz, /readyz)."
  value       = module.gateway.public_endpoint
}

output "admin_url" {
  description = "Admin surface of the gateway, forwarded only from var.admin_cidrs."
  value       = module.gateway.admin_url
}

output "load_balancer_dns_name" {
  description = "The load balancer's DNS name: point a CNAME for gateway.domain_name at it when DNS is not in Route 53."
  value       = module.gateway.load_balancer_dns_name
}

output "gateway_egress_cidrs" {
  description = "The gateway's fixed egress addresses: the only sources the sites admit."
  value       = module.gateway_network.egress_cidrs
}

output "site_endpoints" {
  description = "The gRPC endpoint of every engine the gateway routes to (draining sites excluded), by federation name."
  value       = { for site in local.federation.sites : site.name => site.endpoint }
}

output "federation" {
  description = "The federation file the gateway runs with (GATEWAY_FEDERATION_FILE)."
  value       = jsonencode(local.federation)
}

output "secret_arns" {
  description = "AWS Secrets Manager ARNs of the gateway's bundle (admin_token, mTLS client certificate) and its database credentials."
  value       = module.gateway.secret_arns
}

output "retrain_command" {
  description = "Retrains the length predictor from the collected samples in a one-off task; replace VERSION with a new directory name."
  value       = module.gateway.retrain_command
}

output "site_instance_ids" {
  description = "Instance IDs per site and engine (AWS: for Session Manager)."
  value = merge(
    { for name, site in module.aws_site : name => site.instance_ids },
    { for name, site in module.gcp_site : name => site.instance_ids },
    { for name, site in module.azure_site : name => site.instance_ids },
  )
}
