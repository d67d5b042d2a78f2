output "endpoints" {
  description = "host:port of each engine, in the order of var.instance_names."
  value       = [for name in var.instance_names : "${google_compute_address.engine[name].address}:${var.grpc_port}"]
}

output "public_ips" {
  description = "Fixed external address of each engine, in the order of var.instance_names."
  value       = [for name in var.instance_names : google_compute_address.engine[name].address]
}

output "instance_ids" {
  description = "Compute Engine instance IDs, keyed by engine name."
  value       = { for name, instance in google_compute_instance.engine : name => instance.instance_id }
}
