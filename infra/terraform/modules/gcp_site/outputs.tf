output "endpoints" {
  description = "host:port of each engine, in the order of var.instance_names."
  value       = [for name in var.instance_names : "${google_compute_address.engine[name].address}:${var.grpc_port}"]
}

output "tls_server_names" {
  description = "The DNS name each engine's server certificate carries (the gateway's tls_server_name), in the order of var.instance_names."
  value       = [for name in var.instance_names : tls_cert_request.engine[name].dns_names[0]]
}

output "public_ips" {
  description = "Fixed external address of each engine, in the order of var.instance_names."
  value       = [for name in var.instance_names : google_compute_address.engine[name].address]
}

output "instance_ids" {
  description = "Compute Engine instance IDs, keyed by engine name."
  value       = { for name, instance in google_compute_instance.engine : name => instance.instance_id }
}
