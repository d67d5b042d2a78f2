output "script" {
  description = "The instance's boot script (user data / startup script / custom data)."
  value       = local.script
}

output "environment" {
  description = "The non-secret environment the site engine container starts with."
  value       = local.environment
}
