output "endpoints" {
  description = "host:port of each engine, in the order of var.instance_names."
  value       = [for name in var.instance_names : "${azurerm_public_ip.engine[name].ip_address}:${var.grpc_port}"]
}

output "tls_server_names" {
  description = "The DNS name each engine's server certificate carries (the gateway's tls_server_name), in the order of var.instance_names."
  value       = [for name in var.instance_names : tls_cert_request.engine[name].dns_names[0]]
}

output "public_ips" {
  description = "Static public address of each engine, in the order of var.instance_names."
  value       = [for name in var.instance_names : azurerm_public_ip.engine[name].ip_address]
}

output "instance_ids" {
  description = "Azure VM IDs, keyed by engine name."
  value       = { for name, vm in azurerm_linux_virtual_machine.engine : name => vm.id }
}
