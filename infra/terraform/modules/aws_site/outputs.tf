output "endpoints" {
  description = "host:port of each engine, in the order of var.instance_names."
  value       = [for name in var.instance_names : "${aws_eip.engine[name].public_ip}:${var.grpc_port}"]
}

output "tls_server_names" {
  description = "The DNS name each engine's server certificate carries (the gateway's tls_server_name), in the order of var.instance_names."
  value       = [for name in var.instance_names : tls_cert_request.engine[name].dns_names[0]]
}

output "public_ips" {
  description = "Fixed public address of each engine, in the order of var.instance_names."
  value       = [for name in var.instance_names : aws_eip.engine[name].public_ip]
}

output "instance_ids" {
  description = "EC2 instance IDs (for Session Manager), keyed by engine name."
  value       = { for name, instance in aws_instance.engine : name => instance.id }
}
