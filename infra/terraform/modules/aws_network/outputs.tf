output "vpc_id" {
  description = "ID of the VPC."
  value       = aws_vpc.this.id
}

output "public_subnet_ids" {
  description = "Public subnets, in the order of var.availability_zones."
  value       = [for zone in var.availability_zones : aws_subnet.public[zone].id]
}

output "private_subnet_ids" {
  description = "Private subnets (empty unless private_subnets), in the order of var.availability_zones."
  value       = [for zone in var.availability_zones : aws_subnet.private[zone].id if var.private_subnets]
}

output "egress_cidrs" {
  description = "The NAT gateways' fixed public addresses as /32s: what leaves the private subnets comes from these."
  value       = [for zone in var.availability_zones : "${aws_eip.nat[zone].public_ip}/32" if var.private_subnets]
}
