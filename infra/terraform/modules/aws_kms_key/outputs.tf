output "arn" {
  description = "ARN of the key."
  value       = aws_kms_key.this.arn
}
